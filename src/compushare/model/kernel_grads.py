"""The input's gradient through a frozen quantized matrix: grad_x = grad_y @ W.

torch's weight-only CPU kernels (kernels.py) have no backward. A training pass
(span_training.py) needs only the gradient for the input (the weights are frozen;
LoRA's factors sit beside them), so each kernel gives its weight's rows as it holds
them (`held_rows`: the same values its forward multiplies by, in float32), and the
backward multiplies the output's gradient by them a tile of TILE_ROWS rows at a
time: the matrix is never held dense, and the transient is TILE_ROWS x in_features
floats (4 MB for an 8B model's rows of 4,096).

The forward a backward recomputes is the served one (the same kernel, bfloat16
activations in); only the backward's product is float32 over the held weights.
"""

from __future__ import annotations

import functools

import torch

TILE_ROWS = 256  # rows of a weight dequantized at once in a backward (a multiple of 64)


class FrozenProduct(torch.nn.Module):
    """A kernel computing x @ W.T (`product`) whose input may need a gradient: then
    the product goes through `_Backward`, which asks `held_rows` for W's rows."""

    out_features: int
    in_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _Backward.apply(x, self)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def held_rows(self, start: int, end: int) -> torch.Tensor:
        """W[start:end] as the kernel holds it, float32 [end - start, in_features]."""
        raise NotImplementedError

    def transient_bytes(self) -> int:
        """What a backward holds at once beyond its inputs and outputs: one tile of rows."""
        return 4 * min(TILE_ROWS, self.out_features) * self.in_features * 2  # the values and their codes


def backward_transient_bytes(layers) -> int:
    """The most a backward through `layers` (modules) holds of dequantized rows at once."""
    return max((m.transient_bytes() for layer in layers for m in layer.modules() if isinstance(m, FrozenProduct)),
               default=0)


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, module: FrozenProduct) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module
        with torch.no_grad():
            return module.product(x)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        module: FrozenProduct = ctx.module
        flat = grad_y.reshape(-1, module.out_features).float()
        grad = torch.zeros(flat.shape[0], module.in_features)
        for start in range(0, module.out_features, TILE_ROWS):
            end = min(start + TILE_ROWS, module.out_features)
            grad.addmm_(flat[:, start:end], module.held_rows(start, end))
        return grad.reshape(*grad_y.shape[:-1], module.in_features).to(grad_y.dtype), None


class Int8Rows(FrozenProduct):
    """Rows of a per-row-scaled int8 matrix (`q`, `scale` as Int8Linear holds them)."""

    q: torch.Tensor
    scale: torch.Tensor

    def held_rows(self, start: int, end: int) -> torch.Tensor:
        return self.q[start:end].float() * self.scale[start:end, None].float()


class Int4Rows(FrozenProduct):
    """Rows of a matrix packed for `_weight_int4pack_mm_for_cpu` (`packed`,
    `scales_and_zeros` [groups * planes, N, 2]; weight = (code - 8) * scale + zero, two
    planes side by side along the input added up), unpacked from the layout the packer
    gave (kernels.pack_int4)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    planes: int = 1

    def held_rows(self, start: int, end: int) -> torch.Tensor:
        width = self.packed.shape[1] * 2  # codes a row, every plane
        codes = unpacked_rows(self.packed, start, end, width)
        if codes is None:  # a layout not known here: the kernel itself shows its rows (slower)
            return self._probed_rows(start, end)
        held = self.scales_and_zeros[:, start:end].float()
        scale = held[..., 0].t().repeat_interleave(self.group_size, dim=1)
        zero = held[..., 1].t().repeat_interleave(self.group_size, dim=1)
        values = (codes.float() - 8.0) * scale + zero
        if self.planes == 2:
            values = values[:, :self.in_features] + values[:, self.in_features:]
        return values

    def _probed_rows(self, start: int, end: int) -> torch.Tensor:
        with torch.no_grad():
            return self.product(torch.eye(self.in_features)).t()[start:end].float()


def unpacked_rows(packed: torch.Tensor, start: int, end: int, width: int) -> torch.Tensor | None:
    """Rows start:end of uint8 codes [N, width] packed by kernels.pack_int4, or None
    where the layout is not one decoded here (a torch release that changed it)."""
    rows = packed.shape[0]
    if rows % 64 == 0 and shuffle_matches_converter():  # tiles of 64 rows: byte (k, i) = rows i and i + 32
        if start % 64 or (end % 64 and end != rows):
            return None
        tiles = packed[start:end].reshape(-1, width, 32).transpose(1, 2)
        return torch.stack([tiles & 0x0F, tiles >> 4], dim=1).reshape(end - start, width)
    if rows % 32 or start % 32 or end % 32 or not _converter_layout_known():
        return None
    # torch's converter: blocks of 32 rows; in each, 4 codes of 16 rows' low nibbles,
    # then their high nibbles (rows 16..31), column by column.
    block = packed.reshape(-1)[start * width // 2:end * width // 2].reshape(-1, width // 4, 4, 16)
    both = torch.stack([block & 0x0F, block >> 4], dim=3)  # [blocks, k / 4, 4, low/high, 16 rows]
    return both.permute(0, 3, 4, 1, 2).reshape(end - start, width)


@functools.cache
def shuffle_matches_converter() -> bool:
    """Whether kernels.pack_int4's byte shuffle gives torch's converter's very bytes
    (releases differ: then the converter packs, and its layout is read back here)."""
    codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tiles = codes.reshape(2, 2, 32, 64)
    shuffled = (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2).reshape(128, 32)
    return torch.equal(shuffled, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


@functools.cache
def _converter_layout_known() -> bool:
    """Whether `unpacked_rows` reads `_convert_weight_to_int4pack_for_cpu`'s layout (checked once)."""
    codes = torch.randint(0, 16, (64, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    block = packed.reshape(-1, 96 // 4, 4, 16)
    both = torch.stack([block & 0x0F, block >> 4], dim=3).permute(0, 3, 4, 1, 2).reshape(64, 96)
    return torch.equal(both.to(torch.int32), codes)
