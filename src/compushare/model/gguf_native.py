"""A GGUF file's own tensor types, kept as they are (the `gguf` weight format).

Every matrix of a GGUF model is stored as the file's own bytes: U8 [out, row bytes],
each row a run of whole ggml blocks (so rows can be permuted or stacked exactly),
its ggml type named in the manifest (formats.py). Here, per type, what those bytes
mean, in numpy only (no torch): the kernels (kernels.py) and the consumer's head
(head.py) build on it.

Types with one scale and one offset per 32 weights are read as "affine groups":
integer codes c (0..2^bits - 1) with w = scale * c + min per group, which torch's
4-bit kernel runs holding each weight within bfloat16's rounding (kernels.int4_planes):

  Q4_0  18 B / 32: d (f16), 16 B of nibbles        w = d (c - 8)
  Q4_1  20 B / 32: d, m (f16), nibbles             w = d c + m
  Q5_0  22 B / 32: d, 4 B of 5th bits, nibbles     w = d (c - 16)
  Q5_1  24 B / 32: d, m, 4 B of 5th bits, nibbles  w = d c + m
  Q8_0  34 B / 32: d, 32 int8 q                    w = d q  (c = q + 128)
  Q4_K  144 B / 256: d, dmin (f16), 12 B of 6-bit sub-block scales and mins, 128 B of
        nibbles; 8 sub-blocks of 32: w = d sc_j c - dmin m_j
  Q5_K  176 B / 256: as Q4_K plus 32 B of 5th bits

Nibbles: in Q4_0 / Q4_1 / Q5_*, byte j of a block holds element j (low nibble) and
element j + 16 (high); in Q4_K / Q5_K each 32-byte run holds sub-block 2i in its low
nibbles and 2i + 1 in its high ones. Other types (Q6_K: a scale per 16 weights, which
no torch kernel takes; Q2_K, Q3_K, IQ*) are read as values, through gguf-py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GROUP = 32  # the affine groups' width: the int4 kernel's smallest group size
DENSE_TYPES = {"F32": np.float32, "F16": np.float16}  # BF16 is read as raw 16-bit words
# type -> (weights per block, bytes per block), ggml's (gguf.GGML_QUANT_SIZES)
AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8}


def block_geometry(kind: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of ggml type `kind`."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights, or ValueError if blocks do not tile it."""
    weights, size = block_geometry(kind)
    if in_features % weights:
        raise ValueError(f"{kind} rows hold multiples of {weights} weights, not {in_features}")
    return in_features // weights * size


def in_features_of(kind: str, raw_row_bytes: int) -> int:
    weights, size = block_geometry(kind)
    if raw_row_bytes % size:
        raise ValueError(f"{raw_row_bytes} bytes are not whole {kind} blocks of {size}")
    return raw_row_bytes // size * weights


def held_bytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes the kernel of a [rows, row bytes] matrix of `kind` holds (model/kernels.py):
    4-bit codes and a bfloat16 scale and zero per 32 weights for affine types (twice
    for 5 to 8 bits), float16 / bfloat16 / float32 values for the rest."""
    rows, in_features = shape[0], in_features_of(kind, shape[1])
    if kind in AFFINE_BITS and rows % 16 == 0:
        planes = 1 if AFFINE_BITS[kind] <= 4 else 2
        return planes * rows * (in_features // 2 + in_features // GROUP * 4)
    return rows * in_features * (4 if kind == "F32" else 2)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's rotary row permutation of attn_q / attn_k,
    on any array whose first axis is the rows (values or a row's raw blocks alike)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's rotary row permutation of attn_q / attn_k (the inverse
    of `unpermute`): what a Llama file holds, and what ggml's "normal" rope computes on."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, in] values of raw rows [rows, bytes], as gguf-py computes them."""
    if kind == "F32":
        return np.ascontiguousarray(raw).view(np.float32).copy()
    import gguf

    return gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[kind]).astype(
        np.float32, copy=False)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as float32 [..., 1]."""
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_split(quants: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: element j low nibble of byte j, j + 16 high."""
    return np.concatenate([quants & 0x0F, quants >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block:
    bytes 0-3 and 4-7 hold scales and mins 0-3 in their low 6 bits (and the top 2
    bits of 4-7's); bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and of
    mins 4-7 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def affine_groups(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw rows [rows, bytes] of an AFFINE_BITS type -> (codes uint8 [rows, in],
    scale, min float32 [rows, in / 32]) with w = scale * code + min per group of 32.
    Scales and mins are exact in float32 (f16 times a small integer)."""
    rows = raw.shape[0]
    weights, size = block_geometry(kind)
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        low = blocks[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        codes = (low & 0x0F).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":  # byte l of the 32 holds element l's 5th bit of sub-block i in bit i
            high = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            codes = codes | ((high & 1) << 4)
        scale, minimum = d * sc, -(dmin * mn)
        return codes.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1)
    d = _f16(blocks, 0)
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(rows, -1), d.reshape(rows, -1), (-128 * d).reshape(rows, -1)
    with_min = kind in ("Q4_1", "Q5_1")
    at = 4 if with_min else 2
    minimum = _f16(blocks, 2) if with_min else None
    if kind in ("Q5_0", "Q5_1"):
        bits = blocks[..., at:at + 4].copy().view("<u4")  # bit j: element j's 5th bit
        high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = _nibbles_split(blocks[..., at + 4:]) | (high << 4)
        offset = 16
    else:
        codes, offset = _nibbles_split(blocks[..., at:]), 8
    if minimum is None:
        minimum = -offset * d
    return codes.reshape(rows, -1), d.reshape(rows, -1), minimum.reshape(rows, -1)


# Random blocks: per type, (the rms of code * sub-block scale with d = 1, where the
# f16 fields d and (if any) m / dmin sit, m / dmin in units of d). m / dmin is chosen so
# that a weight's mean is ~0, as a trained model's is (a shared mean would give every
# row one direction and every prompt the same next token).
MXFP4_RMS = float(np.sqrt(np.mean(np.square([0, 1, 2, 3, 4, 6, 8, 12]))))  # ggml's doubled E2M1 values
_RANDOM = {"Q4_0": (4.6, 0, None, 0), "Q4_1": (4.6, 0, 2, -7.5), "Q5_0": (9.2, 0, None, 0),
           "Q5_1": (9.2, 0, 2, -15.5), "Q8_0": (74.0, 0, None, 0), "Q4_K": (36 * 4.6, 0, 2, 7.5),
           "Q5_K": (36 * 9.2, 0, 2, 15.5), "Q6_K": (74 * 18.5, 208, None, 0)}


def random_rows(kind: str, rows: int, in_features: int, rng: np.random.Generator, std: float = 0.02
                ) -> np.ndarray:
    """Valid random raw rows [rows, bytes] of `kind` with weights of about `std` around 0
    (for K-quants, which gguf-py cannot quantize, and for timing blocks not held):
    random bytes, with finite scales set to give that spread."""
    if kind in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, in_features), dtype=np.float32) * std
        if kind == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return values.astype(DENSE_TYPES[kind]).view(np.uint8).reshape(rows, -1)
    _, size = block_geometry(kind)
    blocks = rng.integers(0, 256, size=(rows, row_bytes(kind, in_features) // size, size), dtype=np.uint8)
    if kind == "MXFP4":  # an E8M0 exponent, then 32 FP4 (E2M1) codes: ggml's values +-{0 .. 12} x 2^(e - 128)
        exponent = 128 + np.log2(std / MXFP4_RMS)
        blocks[..., 0] = np.round(exponent + rng.random(blocks.shape[:2]) - 0.5).astype(np.uint8)
        return blocks.reshape(rows, -1)
    spread, at_d, at_m, m_in_d = _RANDOM[kind]
    d = (std / spread) * (0.5 + rng.random(blocks.shape[:2], dtype=np.float32))
    blocks[..., at_d:at_d + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if at_m is not None:
        blocks[..., at_m:at_m + 2] = (m_in_d * d).astype(np.float16)[..., None].view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # each sub-block's min equal to its scale: w = d sc (c - mean)
        blocks[..., 8:12] = blocks[..., 4:8]
        blocks[..., 12:16] = (blocks[..., 12:16] & 0x0F) * 17
    return blocks.reshape(rows, -1)


def read_rows(path, begin: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes of `shape` (rows [rows, bytes], say) at byte `begin` of a file, read
    into memory of their own (plain reads: a mapping would stay in the process's RSS)."""
    out = np.empty(shape, dtype=np.uint8)
    with open(path, "rb") as handle:
        handle.seek(begin)
        if handle.readinto(out.data.cast("B")) != out.nbytes:
            raise ValueError(f"{Path(path).name} ends inside the {out.nbytes} bytes at byte {begin}")
    return out


class MappedRows:
    """Rows of a matrix's raw blocks in a file, memory-mapped: only the rows asked for
    are read (and dequantized), so a 128k-token embedding stays on disk."""

    def __init__(self, path, begin: int, shape: tuple[int, int], kind: str) -> None:
        self.kind = kind
        self.rows = np.memmap(path, dtype=np.uint8, mode="r", offset=begin, shape=shape)

    def __call__(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), in] values of rows `ids`."""
        return dequantize(np.asarray(self.rows[np.asarray(ids, dtype=np.int64)]), self.kind)
