"""The matrix products of each weight format, behind one interface: `linear(...)`.

torch's own weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are fast only with bfloat16 activations (24 us for a SmolLM2 576x1536 product against
fp32's 45; with float32 ones, reference loops: 575 and 1,280 us), so activations enter
them as bfloat16 and leave as float32: the residual stream, norms and attention stay
float32. torchao's CPU weight-only paths call these same kernels: a dependency (and a
torch-version coupling) without speed, so they are called here directly.

Each device type registers its kernels in KERNELS under its name: "cuda" runs every
quantized format through torch's `_weight_int4pack_mm` (the CUDA section below); a
device type with none gets DequantizedLinear, correct everywhere and fast nowhere. The
CPU kernels' backward (the input's gradient: weights stay frozen) is kernel_grads.py's.

A gguf model's matrices (raw ggml blocks, model/gguf_native.py) run on the kernel of
their ggml type, registered below as ("cpu", "gguf:TYPE"): Q4_0, Q4_1 and Q4_K on the
int4 kernel at group 32; Q5_*, Q8_0 as two 4-bit planes; Q6_K (a scale per 16, which no
int4 group takes) and F16 as float16; BF16 and F32 dense. docs/performance.md has each
type's speed (bench/gguf_kernels.py) and what bounds it.

The int4 kernel holds each group's scale and zero in bfloat16 (it has no fast path
with float32 ones: 30x slower). Held as int4_planes does, a symmetric type's weight
(Q4_0, Q5_0, Q8_0) is within 2^-8 of its value, relative: what a bfloat16 copy of the
dequantized matrix would hold; a type with a min (Q4_1, Q5_1, Q4_K, Q5_K) within
2^-8 (|w| + 2^(bits-1) |scale|) in a group whose range holds 0 (the zero's rounding).
The product's input and output are bfloat16. 5- to 8-bit types keep every bit of their
codes (two 4-bit planes, the input met twice in one call), so a mixed file keeps its
mix: nothing is served at fewer bits than stored. Float16 products that overflow are
computed again in float32.
Any other type gguf-py reads (Q2_K, Q3_K, IQ*) is dequantized to float16.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from . import gguf_native
from .formats import MIN_SUFFIX, SCALE_SUFFIX
from .kernel_grads import FrozenProduct, Int4Rows, Int8Rows, shuffle_matches_converter
from .quantize import dequantize, unpack_nibbles

log = logging.getLogger(__name__)

ACTIVATION = torch.bfloat16  # what torch's weight-only CPU kernels are fast with


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fresh, contiguous storage from torch's allocator (64-byte aligned)."""
    return tensor.contiguous().clone() if tensor.data_ptr() % 64 else tensor.contiguous()


class Int8Linear(Int8Rows):
    """y = x @ (q * scale).T with per-row scales, through `_weight_int8pack_mm`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        # A copy of its own: a file's tensor may start at any byte, and the kernel's multi-row
        # path faults on int8 weights not 64-byte aligned (seen: 8 bytes off, 5 rows).
        self.register_buffer("q", aligned(q))
        self.register_buffer("scale", aligned(scale.to(ACTIVATION)))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int4CpuLinear(Int4Rows):
    """y = x @ (q * scale + min).T in groups, through `_weight_int4pack_mm_for_cpu`,
    whose weights are (q - 8) * scale + zero: so zero = min + 8 * scale."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        super().__init__()
        codes = unpack_nibbles(packed)
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scale.shape[1]
        codes, scales_and_zeros = int4_planes(codes, scale.float(), minimum.float(), 1)
        self.register_buffer("packed", pack_int4(codes))
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    def product(self, x: torch.Tensor) -> torch.Tensor:
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


class GroupedInt4Linear(Int4Rows):
    """y = x @ W.T for W in affine groups of 32 (a GGUF type, gguf_native.affine_groups:
    w = scale * code + min) through `_weight_int4pack_mm_for_cpu`, whose weights are
    (c - 8) * scale + zero with scale and zero held in bfloat16. Codes of 4 bits go in
    as they are. Codes of 5 to 8 bits go in as two 4-bit planes side by side along the
    input, low nibbles with the scale and high nibbles with 16x it, and the input
    meets both: one kernel call at 8 bits a weight, each value held within the
    bfloat16 rounding int4_planes states (torch has no kernel at 5, 6 or 8 bits with groups).
    Built ROWS_AT_ONCE rows at a time (the packed layout is separable in tiles of 64
    rows): a 128k-row LM head would take 2 GB of int32 codes at once."""

    ROWS_AT_ONCE = 2048

    def __init__(self, raw: torch.Tensor, kind: str) -> None:
        super().__init__()
        self.out_features = raw.shape[0]
        self.in_features = gguf_native.in_features_of(kind, raw.shape[1])
        self.planes, self.group_size = 1 if gguf_native.AFFINE_BITS[kind] <= 4 else 2, GGUF_GROUP
        width = self.in_features * self.planes  # codes a row, both planes side by side
        self.register_buffer("packed", torch.empty(self.out_features, width // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(width // GGUF_GROUP, self.out_features, 2,
                                                             dtype=ACTIVATION))
        for row in range(0, self.out_features, self.ROWS_AT_ONCE):
            rows = slice(row, row + self.ROWS_AT_ONCE)
            self.packed[rows], self.scales_and_zeros[:, rows] = self._pack(raw[rows].numpy(), kind)
        release_freed_memory()

    def _pack(self, raw, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale, minimum = (torch.from_numpy(a) for a in gguf_native.affine_groups(raw, kind))
        codes, scales_and_zeros = int4_planes(codes, scale, minimum, self.planes)
        return pack_int4(codes), scales_and_zeros

    def product(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION)
        if self.planes == 2:
            flat = torch.cat([flat, flat], dim=-1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GGUF_GROUP, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def int4_planes(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, planes: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] (w = scale * code + min per group; scale, min float32 [N, groups])
    as torch's int4 kernels take them, whose weights are (c - 8) * scale + zero with
    scale and zero in bfloat16: (4-bit codes uint8 [N, K * planes], scales_and_zeros
    bfloat16 [groups * planes, N, 2]). Two planes for codes of 5 to 8 bits (see
    GroupedInt4Linear), the input to be met twice."""
    held = scale.to(ACTIVATION).float()  # the scale as the kernel holds it
    # Each weight held as (c - c0) * held + rest, c0 the code nearest the group's zero:
    # the scale's rounding then moves a weight by 2^-8 of |w - rest| at most, and
    # symmetric types (Q4_0, Q5_0, Q8_0, int8: rest = 0) are held as bfloat16 would
    # hold each weight, whatever the code's distance from the group's minimum.
    centre = torch.round(-minimum / torch.where(scale == 0, 1.0, scale))
    minimum = (minimum + centre * scale) - centre * held
    if planes == 1:
        scales, zeros = held, minimum + 8.0 * held
    else:
        # The two planes' zeros must add up to min + 136 * scale; 8 * scale and
        # 128 * scale are exact in bfloat16, so the one rounded zero is the smaller
        # of min + 8 scale and min + 128 scale (Q8_0's is 0: exact).
        low, high = minimum + 8.0 * held, minimum + 128.0 * held
        first = low.abs() <= high.abs()
        zeros = torch.cat([torch.where(first, low, 8.0 * held), torch.where(first, 128.0 * held, high)], dim=1)
        codes, scales = torch.cat([codes & 0x0F, codes >> 4], dim=1), torch.cat([held, 16.0 * held], dim=1)
    return codes, torch.stack([scales.t(), zeros.t()], dim=-1).to(ACTIVATION)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) in `_weight_int4pack_mm_for_cpu`'s packed layout. Its
    own converter takes int32 codes and is ~10x slower than the byte shuffle that gives
    its layout (tiles of 64 rows: byte (k, i) of a tile holds row i's code k low and row
    i + 32's high), which loading an 8B model's span does hundreds of times: the
    shuffle is used where it is checked, once, to give the converter's very bytes."""
    rows, cols = codes.shape
    if rows % 64 or not shuffle_matches_converter():
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    tiles = codes.reshape(rows // 64, 2, 32, cols)
    return (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2).reshape(rows, cols // 2).contiguous()


class DenseLinear(FrozenProduct):
    """A dense matrix computed in its own dtype, float32 out: a GGUF's F32, F16 and BF16
    matrices, and its types without a kernel dequantized to float16 (Q6_K, whose scale
    per 16 weights the int4 kernel cannot take: float16 keeps 11 bits, more than its 6).
    A float16 product overflows past 65504: one that does is computed again in float32.
    Its backward is float32 tiles of its rows (a CPU's float16 matmul is slow)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.nn.functional.linear(flat.to(self.weight.dtype), self.weight)
        if self.weight.dtype == torch.float16 and not bool(torch.isfinite(out).all()):
            out = torch.nn.functional.linear(flat.float(), self.weight.float())
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def held_rows(self, start: int, end: int) -> torch.Tensor:
        return self.weight[start:end].float()


GGUF_GROUP = gguf_native.GROUP


def _gguf_values(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """A GGUF matrix's raw rows as a dense tensor: F32 / F16 / BF16 as they are, any
    other type dequantized (gguf-py) to float16."""
    if kind in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        return raw.contiguous().view(dtype).clone()
    rows = GroupedInt4Linear.ROWS_AT_ONCE  # float32 values of a whole LM head would be 2 GB
    out = torch.empty(raw.shape[0], gguf_native.in_features_of(kind, raw.shape[1]), dtype=torch.float16)
    for row in range(0, raw.shape[0], rows):
        out[row:row + rows] = torch.from_numpy(gguf_native.dequantize(raw[row:row + rows].numpy(), kind))
    release_freed_memory()
    return out


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system. Building a kernel frees many
    chunk-sized transients (MBs each) that glibc keeps in its heap once its mmap
    threshold has grown past them: 0.5 GB of RSS after an 8B model's LM head."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _load_malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None


_malloc_trim = _load_malloc_trim()


def _gguf_affine(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.nn.Module]:
    def make(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
        raw = parts[""]
        if raw.shape[0] % 16:  # the packed layout wants output rows in tiles of 16
            return DenseLinear(_gguf_values(kind, raw))
        return GroupedInt4Linear(raw, kind)
    return make


def _gguf_dense(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.nn.Module]:
    return lambda parts: DenseLinear(_gguf_values(kind, parts[""]))


# --- CUDA: every quantized format through torch's `_weight_int4pack_mm` ---------------
#
# torch's CUDA weight-only kernel (tinygemm, sm80 and later) takes 4-bit codes with a
# bfloat16 scale and zero per group of 32..256 inputs: our q4 and GGUF's 4-bit types
# go in as they are (group 32 / 64 / 128), every 5- to 8-bit code as two planes
# (int4_planes), our int8 too (per-row scale; the code q + 128; group = the largest
# of 256..32 dividing the row): one kernel for every format, 8 bits a weight read for
# int8 as `_weight_int8pack_mm` would, which has no CUDA kernel in the torch releases
# this was written against (CPU and MPS only). Where the int4 kernel is missing or
# wrong on a device (checked once per device against the dequantized product:
# `cuda_int4_form`), every quantized matrix is served dequantized to bfloat16
# (DequantizedLinear: cuBLAS, correct, 2 bytes a weight), and a warning says why.

CUDA_INT4_GROUPS = (256, 128, 64, 32)


def inner_k_tiles(in_features: int) -> int | None:
    """`_convert_weight_to_int4pack`'s innerKTiles for rows of `in_features` codes: the
    largest of 8, 4, 2 with in_features a multiple of 16 x it; None if none fits."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0), None)


def cuda_int4_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether the CUDA int4 kernel takes an [out, in] matrix in groups of `group`:
    output rows in tiles of 8, input in whole k-tiles and groups."""
    return (out_features % 8 == 0 and group in CUDA_INT4_GROUPS and in_features % group == 0
            and inner_k_tiles(in_features) is not None)


def _cuda_pack_argument(codes: torch.Tensor, form: str) -> torch.Tensor:
    """4-bit codes uint8 [N, K] as `_convert_weight_to_int4pack` takes them: since torch
    2.5, uint8 [N, K / 2] with element 2j in the HIGH nibble of byte j ("uint8"); before,
    int32 [N, K] ("int32")."""
    if form == "uint8":
        return ((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous()
    return codes.to(torch.int32).contiguous()


def cuda_pack_int4(codes: torch.Tensor, device: torch.device, form: str) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) packed on `device` for `_weight_int4pack_mm`."""
    return torch.ops.aten._convert_weight_to_int4pack(_cuda_pack_argument(codes, form).to(device),
                                                      inner_k_tiles(codes.shape[1]))


@functools.cache
def cuda_int4_form(device: torch.device) -> str | None:
    """Which argument form of `_convert_weight_to_int4pack` gives, on `device`, the
    product of the dequantized weights (checked on a 64 x 256 matrix in groups of 32);
    None, with a warning saying why, where none does (compute capability below 8.0,
    a torch without the kernel, a changed layout)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        log.warning("CUDA int4 kernel: %s has compute capability %d.%d, below 8.0: quantized matrices run "
                    "dequantized to bfloat16", device, major, minor)
        return None
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 256), dtype=torch.uint8, generator=generator)
    scale = torch.rand(64, 8, generator=generator) * 0.01 + 0.001
    minimum = torch.randn(64, 8, generator=generator) * 0.01
    x = torch.randn(3, 256, generator=generator).to(ACTIVATION)
    expected = x.float() @ (codes.float() * scale.repeat_interleave(32, 1) + minimum.repeat_interleave(32, 1)).t()
    four, scales_and_zeros = int4_planes(codes, scale, minimum, 1)
    failures = []
    for form in ("uint8", "int32"):
        try:
            packed = cuda_pack_int4(four, device, form)
            got = torch.ops.aten._weight_int4pack_mm(x.to(device), packed, 32, scales_and_zeros.to(device))
            error = float((got.float().cpu() - expected).abs().max() / expected.abs().max())
        except RuntimeError as exc:
            failures.append(f"{form}: {str(exc).splitlines()[0]}")
            continue
        if error < 0.02:  # bfloat16 input, scales and output: ~0.4 % each
            return form
        failures.append(f"{form}: relative error {error:.3g}")
    log.warning("CUDA int4 kernel unusable on %s (torch %s): %s; quantized matrices run dequantized to bfloat16",
                device, torch.__version__, "; ".join(failures))
    return None


class CudaInt4Linear(torch.nn.Module):
    """y = x @ W.T on a CUDA device through `_weight_int4pack_mm`, for 4-bit codes
    (planes = 1) or 5- to 8-bit codes as two 4-bit planes (planes = 2, the input met
    twice): codes and scales_and_zeros as int4_planes gives them, packed on the device
    ROWS_AT_ONCE rows at a time (the packed layout is separable in tiles of 8 rows)."""

    ROWS_AT_ONCE = 4096

    def __init__(self, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, planes: int,
                 device: torch.device, form: str) -> None:
        super().__init__()
        self.out_features, width = codes.shape
        self.in_features, self.group, self.planes = width // planes, group, planes
        packed = [cuda_pack_int4(codes[row:row + self.ROWS_AT_ONCE], device, form)
                  for row in range(0, self.out_features, self.ROWS_AT_ONCE)]
        self.register_buffer("packed", packed[0] if len(packed) == 1 else torch.cat(packed))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device).contiguous())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION)
        if self.planes == 2:
            flat = torch.cat([flat, flat], dim=-1)
        out = torch.ops.aten._weight_int4pack_mm(flat.contiguous(), self.packed, self.group, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def cuda_device() -> torch.device:
    """The CUDA device kernels are built on: the current one (SpanRunner sets it)."""
    return torch.device("cuda", torch.cuda.current_device())


def _q4_cuda(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
    device = cuda_device()
    codes, scale, minimum = unpack_nibbles(parts[""]), parts[SCALE_SUFFIX].float(), parts[MIN_SUFFIX].float()
    group = codes.shape[1] // scale.shape[1]
    form = cuda_int4_form(device)
    if form is None or not cuda_int4_fits(codes.shape[0], codes.shape[1], group):
        return DequantizedLinear(parts).to(device)
    codes, scales_and_zeros = int4_planes(codes, scale, minimum, 1)
    return CudaInt4Linear(codes, scales_and_zeros, group, 1, device, form)


def _int8_cuda(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Per-row int8 (w = q * scale) as 8-bit codes q + 128 in groups sharing the row's
    scale (min = -128 * scale): two int4 planes, 8.5 bits a weight read at group 128."""
    device = cuda_device()
    q = parts[""]
    group = next((g for g in CUDA_INT4_GROUPS if q.shape[1] % g == 0), 0)
    form = cuda_int4_form(device)
    if form is None or not cuda_int4_fits(q.shape[0], q.shape[1] * 2, group):
        return DequantizedLinear(parts).to(device)
    codes, scales_and_zeros = int8_as_int4_planes(q, parts[SCALE_SUFFIX], group)
    return CudaInt4Linear(codes, scales_and_zeros, group, 2, device, form)


def int8_as_int4_planes(q: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 (w = q * scale) as int4_planes' two planes: codes q + 128, every
    group of a row with the row's scale and min -128 * scale (its zeros 8 * scale and
    0: exact, so the weights are q * scale with the scale in bfloat16, as Int8Linear's)."""
    out_features, in_features = q.shape
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    scales = scale.float().unsqueeze(1).expand(out_features, in_features // group)
    return int4_planes(codes, scales, -128.0 * scales, 2)


def _gguf_affine_cuda(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.nn.Module]:
    planes = 1 if gguf_native.AFFINE_BITS[kind] <= 4 else 2

    def make(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
        device, raw = cuda_device(), parts[""]
        in_features = gguf_native.in_features_of(kind, raw.shape[1])
        form = cuda_int4_form(device)
        if form is None or not cuda_int4_fits(raw.shape[0], in_features * planes, GGUF_GROUP):
            return DenseLinear(_gguf_values(kind, raw)).to(device)
        pieces = [int4_planes(*(torch.from_numpy(a) for a in gguf_native.affine_groups(
            raw[row:row + GroupedInt4Linear.ROWS_AT_ONCE].numpy(), kind)), planes)
            for row in range(0, raw.shape[0], GroupedInt4Linear.ROWS_AT_ONCE)]
        codes = torch.cat([codes for codes, _ in pieces])
        scales_and_zeros = torch.cat([sz for _, sz in pieces], dim=1)
        del pieces
        module = CudaInt4Linear(codes, scales_and_zeros, GGUF_GROUP, planes, device, form)
        release_freed_memory()
        return module
    return make


def _gguf_dense_cuda(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.nn.Module]:
    return lambda parts: DenseLinear(_gguf_values(kind, parts[""])).to(cuda_device())


# (device type, format name) -> constructor from a matrix's stored parts; a GGUF
# matrix's format name is "gguf:" and its ggml type (parts: {"": raw rows}).
KERNELS: dict[tuple[str, str], Callable[[dict[str, torch.Tensor]], torch.nn.Module]] = {
    ("cpu", "int8"): _int8,
    ("cpu", "q4"): _q4_cpu,
} | {("cpu", f"gguf:{kind}"): _gguf_affine(kind) for kind in gguf_native.AFFINE_BITS} | {
    ("cpu", f"gguf:{kind}"): _gguf_dense(kind) for kind in ("F32", "F16", "BF16", "Q6_K")} | {
    ("cuda", "int8"): _int8_cuda,
    ("cuda", "q4"): _q4_cuda,
} | {("cuda", f"gguf:{kind}"): _gguf_affine_cuda(kind) for kind in gguf_native.AFFINE_BITS} | {
    ("cuda", f"gguf:{kind}"): _gguf_dense_cuda(kind) for kind in ("F32", "F16", "BF16", "Q6_K")}


class WithBias(torch.nn.Module):
    """A quantized product plus a float32 bias (Qwen2's q, k and v projections have one)."""

    def __init__(self, product: torch.nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.product = product
        self.register_buffer("bias", bias.float().clone())  # its own: a file's tensor keeps the file mapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x) + self.bias


def kernel_for(device_type: str, parts: dict[str, torch.Tensor], gguf_type: str | None = None
               ) -> Callable[[dict[str, torch.Tensor]], torch.nn.Module]:
    """The constructor KERNELS registers for a matrix on a device type, or the fallback
    every device runs: a GGUF type's values dense (DenseLinear), our formats dequantized
    to bfloat16 (DequantizedLinear)."""
    if gguf_type is not None:
        return KERNELS.get((device_type, f"gguf:{gguf_type}")) or (
            lambda parts: DenseLinear(_gguf_values(gguf_type, parts[""])))
    own = "q4" if MIN_SUFFIX in parts else "int8"
    return KERNELS.get((device_type, own)) or DequantizedLinear


def linear(parts: dict[str, torch.Tensor], device: str | torch.device = "cpu", bias: torch.Tensor | None = None,
           *, gguf_type: str | None = None) -> torch.nn.Module:
    """A module computing x @ W.T (+ bias) for the stored matrix `parts` ({"": weight}
    when dense; plus "_scale" / "_min" when quantized; {"": raw rows} of ggml type
    `gguf_type`), its tensors on `device`. Dense weights give a plain nn.Linear, op for
    op what transformers runs. A CUDA kernel is built on the current CUDA device."""
    device = torch.device(device)
    if bias is not None:
        return WithBias(linear(parts, device, gguf_type=gguf_type), bias).to(device)
    if gguf_type is None and SCALE_SUFFIX not in parts:
        weight = parts[""]
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
        module.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
        return module
    return kernel_for(device.type, parts, gguf_type)(parts).to(device)


def embedding_rows(parts: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding matrix in any format, dequantizing only those rows."""
    if SCALE_SUFFIX not in parts:
        return torch.nn.functional.embedding(ids, parts[""]).to(dtype)
    rows = {suffix: tensor[ids.reshape(-1)] for suffix, tensor in parts.items()}
    return dequantize(rows).to(dtype).reshape(*ids.shape, -1)
