"""A GGUF file's own 4-bit quantization, kept as the q4/g32 format (no re-quantizing).

GGUF types kept faithfully, block by block (32 weights along a row each):
  Q4_1  w = d * q + m        -> scale d, min m (both float16 in the file and in ours)
  Q4_0  w = d * (q - 8)      -> scale d, min -8 * d (exact in float16: a power-of-two multiple)
Any other type (Q4_K, Q5_*, Q8_0, F16 ...) is not representable without a change of
values: those matrices are dequantized (as transformers does) and quantized by our own
quantizer, and `models import` says so. Llama's attn_q / attn_k rows are stored permuted
for llama.cpp's rotary layout; the same row permutation transformers undoes is applied to
the integers and scales, which move with their rows.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .formats import MIN_SUFFIX, SCALE_SUFFIX
from .quantize import pack_nibbles

KEPT_TYPES = ("Q4_0", "Q4_1")
GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's rotary row permutation, on any per-row array."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _split_blocks(kind: str, data: np.ndarray, in_features: int) -> dict[str, np.ndarray]:
    """Q4_0 / Q4_1 rows [out, blocks * bytes] -> q [out, in] (0..15), scale, min [out, in / 32]."""
    out_features = data.shape[0]
    blocks = data.reshape(out_features, in_features // GROUP, _BLOCK_BYTES[kind])
    scale = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    if kind == "Q4_1":
        minimum, quants = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0], blocks[:, :, 4:]
    else:
        minimum, quants = (scale * np.float16(-8)).astype(np.float16), blocks[:, :, 2:]
    # ggml: byte j of a block holds element j (low nibble) and element j + 16 (high).
    q = np.concatenate([quants & 0x0F, quants >> 4], axis=2).reshape(out_features, in_features)
    return {"q": q, "scale": scale, "min": minimum}


def native_matrices(gguf_path: Path, config: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({stored name: tensor} of every projection whose GGUF type is kept, {matrix: GGUF
    type} of those that are not)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    llama = config.get("model_type") == "llama"
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    stored: dict[str, torch.Tensor] = {}
    others: dict[str, str] = {}
    for tensor in reader.tensors:
        match = _TENSOR.fullmatch(tensor.name)
        if not match or match.group(2) not in _NAMES:
            continue
        name = f"model.layers.{match.group(1)}.{_NAMES[match.group(2)]}.weight"
        kind = tensor.tensor_type.name
        if kind not in KEPT_TYPES:
            others[name] = kind
            continue
        parts = _split_blocks(kind, np.asarray(tensor.data), int(tensor.shape[0]))
        if llama and match.group(2) in heads:
            parts = {key: _unpermute(value, heads[match.group(2)]) for key, value in parts.items()}
        stored[name] = pack_nibbles(torch.from_numpy(np.ascontiguousarray(parts["q"])))
        stored[name + SCALE_SUFFIX] = torch.from_numpy(np.ascontiguousarray(parts["scale"]))
        stored[name + MIN_SUFFIX] = torch.from_numpy(np.ascontiguousarray(parts["min"]))
    return stored, others
