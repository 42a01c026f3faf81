"""Tiny GGUF files written by tests with the `gguf` package: a Llama whose tensors
come in the ggml types a test names, as llama.cpp's converter lays them out (attn_q /
attn_k rows permuted for its rotary layout, ggml's reversed shapes), with a byte-level
tokenizer that transformers reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# A Q4_K_M-style mix: K-quant projections, 6 bits for v, down and the LM head, an
# 8-bit embedding, float32 norms.
Q4_K_M = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
          "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# K-quants need rows of whole 256-weight super-blocks: hidden and intermediate are multiples of 256.
SHAPE = dict(layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)


def raw_rows(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of `kind`: gguf-py's quantizer where it has one, else random valid blocks."""
    import gguf

    from compushare.model import gguf_native

    if kind in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        if kind == "F32":
            return values.view(np.uint8).reshape(rows, -1)
        return np.ascontiguousarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])).view(
            np.uint8).reshape(rows, -1)
    return gguf_native.random_rows(kind, rows, cols, rng)


def write_tiny_llama(path: Path, types: dict[str, str], *, seed: int = 0, tie: bool = False,
                     arch: str = "llama", extra: dict | None = None) -> Path:
    """`arch` "qwen2": Qwen2's layout instead (q / k / v biases, rows not permuted);
    `extra`: more F32 tensors {GGUF name: array} written as they are."""
    import gguf

    from compushare.model import gguf_native

    s, rng = SHAPE, np.random.default_rng(seed)
    head_dim = s["hidden"] // s["heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test llama")
    writer.add_context_length(512)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(s["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    symbols = _byte_symbols()[:255] + [_byte_symbols()[101] + _byte_symbols()[114]]
    writer.add_token_list(symbols)
    writer.add_token_types([int(gguf.TokenType.NORMAL)] * len(symbols))
    writer.add_token_merges([f"{symbols[101]} {symbols[114]}"])  # "er", the last token
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, role: str, rows: int, cols: int, heads: int | None = None) -> None:
        kind = types[role]
        raw = raw_rows(kind, rows, cols, rng)
        if heads is not None and arch == "llama":
            raw = gguf_native.permute(raw, heads)
        writer.add_tensor(name, raw, raw_shape=None, raw_dtype=gguf.GGMLQuantizationType[kind])
        if arch == "qwen2" and role in ("attn_q", "attn_k", "attn_v"):
            writer.add_tensor(name.replace(".weight", ".bias"), (0.02 * rng.standard_normal(rows)).astype(np.float32))

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", s["vocab"], s["hidden"])
    norm("output_norm.weight", s["hidden"])
    if not tie:
        matrix("output.weight", "output", s["vocab"], s["hidden"])
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        norm(f"blk.{i}.attn_norm.weight", s["hidden"])
        matrix(f"blk.{i}.attn_q.weight", "attn_q", s["hidden"], s["hidden"], s["heads"])
        matrix(f"blk.{i}.attn_k.weight", "attn_k", kv, s["hidden"], s["kv_heads"])
        matrix(f"blk.{i}.attn_v.weight", "attn_v", kv, s["hidden"])
        matrix(f"blk.{i}.attn_output.weight", "attn_output", s["hidden"], s["hidden"])
        norm(f"blk.{i}.ffn_norm.weight", s["hidden"])
        matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", s["intermediate"], s["hidden"])
        matrix(f"blk.{i}.ffn_up.weight", "ffn_up", s["intermediate"], s["hidden"])
        matrix(f"blk.{i}.ffn_down.weight", "ffn_down", s["hidden"], s["intermediate"])
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 byte values as printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    table = dict(zip(printable + extra, printable + [256 + n for n in range(len(extra))]))
    return [chr(table[b]) for b in range(256)]


# llama.cpp's fallbacks for a row that is no whole number of 256-weight super-blocks
# (llama_tensor_get_type): SmolLM2's 576-wide rows take them.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, layers: int, columns: int) -> str | None:
    """The type llama.cpp's Q4_K_M gives a layer matrix (None: kept as it is): Q4_K,
    Q6_K for attn_v and ffn_down in the layers given more bits (the first and last
    eighth, and every third between), each with its fallback for a short row."""
    parts = name.split(".")
    if parts[0] != "blk" or not name.endswith(".weight") or parts[2].endswith("norm"):
        return None
    layer = int(parts[1])
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    kind = "Q6_K" if parts[2] in ("attn_v", "ffn_down") and more_bits else "Q4_K"
    return K_FALLBACK[kind] if columns % 256 else kind


def ggml_quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """[rows, cols] float32 -> [rows, bytes] of `kind`, by ggml's own quantizer (every
    type, the K-quants too, unlike gguf-py's)."""
    import ctypes

    import gguf

    from compushare.spans.ggml.lib import ggml

    values = np.ascontiguousarray(values, dtype=np.float32)
    rows, cols = values.shape
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    kind_id = getattr(ggml, f"GGML_TYPE_{kind}")
    written = ggml.ggml_quantize_chunk(kind_id, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                       out.ctypes.data_as(ctypes.c_void_p), 0, rows, cols, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out


def requantize(source: Path, target: Path, choose=q4_k_m_type) -> Path:
    """`source` with every layer matrix dequantized and quantized again to the type
    `choose(name, layers, columns)` names (Q4_K_M's mix by default), as llama-quantize
    would from the same weights; metadata, norms and the embedding kept as they are."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    layers = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        columns = int(tensor.shape[0])  # ggml's ne: the row's length first
        kind = choose(tensor.name, layers, columns)
        if kind is None:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(tensor.data, tensor.tensor_type).reshape(-1, columns)
        writer.add_tensor(tensor.name, ggml_quantize(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
