"""Int8 quantization of DiLoCo pseudo-gradient parts, with one fp32 scale per chunk. Pure, no I/O.

The butterfly all-reduce sends every part twice in int8 (a contribution to its owner, the owner's
result back to everyone), so a part of n elements costs `wire_bytes(n)` = n + 4·ceil(n/CHUNK) bytes
instead of 4n.

Per chunk of CHUNK elements: scale = absmax / 127 (rounded up to the next fp32 when the division
rounded down, so |x| / scale ≤ 127 always holds and no element is clamped), q = round(x / scale),
a chunk of zeros has scale 0. Dequantizing gives q · scale in fp32; its error per element is at most
`error_bound` = scale · (1/2 + 2^-16) + 2^-149: the int8 rounding plus fp32 rounding of the quotient
and the product (the last term covers subnormal products).

Wire form (msgpack map): {"n": element count, "q": n int8 bytes, "s": little-endian fp32 scales}.
`Quantized.from_wire` is the only parser of peer data here: it checks every field and raises
PeerMisbehaved. Scales are capped at MAX_SCALE, so a peer cannot make dequantized values (nor the sums
and differences an aggregator forms of them) overflow fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compushare.errors import PeerMisbehaved

CHUNK = 256
# quantize refuses |x| > MAX_ABS: no pseudo-gradient comes near it, and it keeps every value in fp32's range.
MAX_ABS = 2.0**100
# >= MAX_ABS / 127 rounded up; dequantized |values| < 2^101, so sums of up to 2^20 of them stay finite.
MAX_SCALE = 2.0**94
WIRE_KEYS = frozenset({"n", "q", "s"})


@dataclass(frozen=True)
class Quantized:
    """A quantized vector: `q` int8 bytes (one per element), `scales` little-endian fp32 (one per chunk)."""

    q: bytes
    scales: bytes
    size: int

    def to_wire(self) -> dict:
        return {"n": self.size, "q": self.q, "s": self.scales}

    @classmethod
    def from_wire(cls, d: object, *, expected_size: int) -> Quantized:
        """Parse a peer's wire map; anything but exactly what `quantize` could produce raises PeerMisbehaved."""
        if not isinstance(d, dict) or set(d) != WIRE_KEYS:
            raise PeerMisbehaved(f"quantized part: want a map with keys {sorted(WIRE_KEYS)}")
        n, q, s = d["n"], d["q"], d["s"]
        if type(n) is not int or n != expected_size:
            raise PeerMisbehaved(f"quantized part: n={n!r}, want {expected_size}")
        if type(q) is not bytes or len(q) != n:
            raise PeerMisbehaved(f"quantized part: q must be {n} bytes")
        if type(s) is not bytes or len(s) != 4 * n_chunks(n):
            raise PeerMisbehaved(f"quantized part: s must be {4 * n_chunks(n)} bytes")
        scales = np.frombuffer(s, dtype="<f4")
        if not (np.isfinite(scales).all() and (scales >= 0).all() and (scales <= MAX_SCALE).all()):
            raise PeerMisbehaved(f"quantized part: scales must be finite and in [0, {MAX_SCALE}]")
        if (np.frombuffer(q, dtype=np.int8) == -128).any():
            raise PeerMisbehaved("quantized part: q holds -128 (quantize uses -127..127)")
        return cls(q=q, scales=s, size=n)


def n_chunks(size: int) -> int:
    return -(-size // CHUNK)


def wire_bytes(size: int) -> int:
    """Bytes of q and scales for a part of `size` elements (the map's framing aside)."""
    return size + 4 * n_chunks(size)


def _padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x flattened to fp32, zero-padded to whole chunks, as (chunks, CHUNK)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = n_chunks(flat.numel()) * CHUNK - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, CHUNK)


def quantize(x: torch.Tensor) -> Quantized:
    """Quantize x (any shape, flattened, cast to fp32); raises ValueError on non-finite or |x| > MAX_ABS."""
    rows = _padded_rows(x)
    size = x.numel()
    absmax = rows.abs().amax(dim=1) if rows.numel() else rows.new_zeros(0)
    if not bool(torch.isfinite(absmax).all()) or bool((absmax > MAX_ABS).any()):
        raise ValueError(f"quantize: values must be finite and within ±{MAX_ABS}")
    scale = absmax / 127
    # Round the scale up where fp32 division rounded it down (fp64 product is exact), so |x|/scale <= 127.
    low = scale.double() * 127 < absmax.double()
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    q_bytes = q.reshape(-1)[:size].numpy().tobytes()
    return Quantized(q=q_bytes, scales=scale.numpy().astype("<f4").tobytes(), size=size)


def _scales(qz: Quantized) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(qz.scales, dtype="<f4").astype(np.float32))


def dequantize(qz: Quantized) -> torch.Tensor:
    """The fp32 vector of `qz.size` elements that `qz` stands for."""
    q = torch.from_numpy(np.frombuffer(qz.q, dtype=np.int8).astype(np.float32))
    return (q * _scales(qz).repeat_interleave(CHUNK)[: qz.size]).contiguous()


def error_bound(qz: Quantized) -> torch.Tensor:
    """Per element, the most |dequantize(quantize(x)) - x| can be: half a step plus fp32 rounding."""
    s = _scales(qz).repeat_interleave(CHUNK)[: qz.size]
    return torch.where(s > 0, s * (0.5 + 2.0**-16) + 2.0**-149, torch.zeros_like(s))


def max_error(qz: Quantized) -> float:
    """The largest per-element error bound of `qz` (0.0 when empty)."""
    b = error_bound(qz)
    return float(b.max()) if b.numel() else 0.0
